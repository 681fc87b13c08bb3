"""The fuzz tests' shared budget."""

from __future__ import annotations

import os

#: Examples per property: OMNI_FUZZ_EXAMPLES, or 2000, which fits the default suite's
#: budget (`omnifabric soak --rows FUZZ` runs both fuzz files at 10,000).
EXAMPLES = int(os.environ.get("OMNI_FUZZ_EXAMPLES", "2000"))
