"""``python -m ds4`` is the ``ds4`` command."""

from .cli import main

raise SystemExit(main())
