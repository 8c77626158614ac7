"""The directory tiers' machinery (``disk``, ``shm`` and ``shared`` are its
kinds, one module each in ``tiers/``):

    files        ``ObjectDir``: the on-disk layout, atomic publication,
                 verified reads, quarantine, temp-file sweeping
    folders      whose folders a tier uses, made and checked
    beneath      an object's whole path opened in one ``openat2``
    filetier     ``FileTier``: the base of the directory kinds
    aio          Linux native AIO through ``ctypes``
    aiostream    ``AioStream``: the Python O_DIRECT driver of a load
    nativestream ``NativeStream``: the native read loop's driver
    readpath     adaptive reads: O_DIRECT or buffered, per load
    readtrace    when a load's reads were in flight (``bench storage``)
    stamps       the shared tier's recency stamps a load owes
    lease        the shared directory's collector lease (a lease file)
"""
