import sys

from services.launcher.cli import main

sys.exit(main())
