from .catalog import main

raise SystemExit(main())
