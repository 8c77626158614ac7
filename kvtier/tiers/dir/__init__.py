"""The directory tiers' machinery (``disk``, ``shm`` and ``shared`` are its
kinds, one module each in ``tiers/``):

    files        ``ObjectDir``, the one door to the files, made of:
      layout     names, folders opened level by level with O_NOFOLLOW
      fileread   verified reads (``open_read``/``finish_read`` for drivers)
      filewrite  atomic publication, removal, recency stamps, quarantine
      filesweep  temp-file and quarantine sweeps, ``scan``
    folders      whose folders a tier uses, made and checked
    beneath      an object's whole path opened in one ``openat2``
    filetier     ``FileTier``: the base of the directory kinds
    aio          Linux native AIO through ``ctypes``
    aiostream    ``AioStream``: the Python O_DIRECT driver of a load
    nativestream ``NativeStream``: the native read loop's driver
    readpath     adaptive reads: O_DIRECT or buffered, per load
    stamps       the shared tier's recency stamps a load owes
    lease        the shared directory's collector lease (a lease file)
"""
