"""`python -m deviceplugin` runs the CLI."""

from deviceplugin.cli import main

raise SystemExit(main())
