"""Reports: what Ember compiled, what ran where, and how long each stage took."""
