import sys

from ringserve.cli import main

sys.exit(main())
