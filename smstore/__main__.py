"""`python -m smstore` is the `smstore` command."""

from smstore.cli import main

raise SystemExit(main())
