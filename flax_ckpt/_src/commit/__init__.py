"""The commit of a checkpoint and what surrounds it: visibility all at once, agreement, recycled files.

Scope of the package: atomic.py (the one atomic commit of every layout, by the storage's declared
capability: rename, or a commit object written last; the temporary names; the atomic placement of a
single file), distributed.py (multi-process agreement: key-value rounds, the vote before a commit) and
recycler.py (the data files of a removed step, written over by the next save). Above storage/ and
serializers/, below the engine and the layouts; nothing here knows a layout's files beyond the name
of its commit record.
"""
