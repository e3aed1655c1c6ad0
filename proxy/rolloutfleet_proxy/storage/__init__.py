"""The proxy's storage: everything it keeps beyond its memory, behind one interface (`Storage`).

`DumpStorage` keeps a dump directory (the journal, snapshots, dumps, export batch files, the state
file); `NoStorage` keeps nothing (dropping sessions was chosen). The runtime chooses one at start;
nothing else asks which.
"""

from .dump_storage import DumpStorage
from .interface import Departure, Pending, RestoredSessions, Storage, Written
from .no_storage import NoStorage

__all__ = ["Departure", "DumpStorage", "NoStorage", "Pending", "RestoredSessions", "Storage", "Written"]
