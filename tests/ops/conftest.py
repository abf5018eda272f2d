"""Each test here runs with a clean Dynamo and a hermetic Ember environment (support/ember_env.py)."""

from ember_env import clean_ember  # noqa: F401 - an autouse fixture
