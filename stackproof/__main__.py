import sys

from stackproof.cli import main

sys.exit(main())
