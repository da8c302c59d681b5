# The face of shardsmith.storage.reading: the names other packages import. Read at import time by lazy_loader
# (attach_stub), so a name's module is imported on first use; type checkers read it as is.

from .execute import ReadStats as ReadStats
from .ranges import planned_read_nbytes as planned_read_nbytes
from .ranges import planned_spans as planned_spans
from .spans import chunk_span as chunk_span
from .spans import intersections as intersections
