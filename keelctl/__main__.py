"""python -m keelctl ... is the same as `keel ...`."""
import sys

from keelctl.main import main

sys.exit(main())
