import sys

from ._pdeathsig import die_with_parent

die_with_parent()  # before the CLI imports anything heavy

from .cli import main  # noqa: E402

sys.exit(main())
