"""``python -m ember``: the same as the ``ember`` command."""

from ember.cli import main

raise SystemExit(main())
