"""``python -m outboxpg.cli``: the ``outboxpg`` command."""

import sys

from outboxpg.cli.outboxpg import main

sys.exit(main())
