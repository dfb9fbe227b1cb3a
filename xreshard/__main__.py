"""``python -m xreshard ...``: the same as the ``xreshard`` script."""

from .cli import main

raise SystemExit(main())
