from kvshim.cli import main

raise SystemExit(main())
