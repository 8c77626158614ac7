"""``kvtier check``: what a node needs before a rollout, checked in one run.

    report    rows (OK, WARN, FAIL, with the fix), the table, JSON, exit status
    inputs    the configuration as the engine reads it: ``--config``,
              ``--kv-transfer-config`` and ``KVTIER_*``
    folders   the directory tiers' folders: owner, mode, mount, format, free space
    services  Redis and S3 reached with the configured credentials
    node      the cluster key file, the vLLM release, chunk size and block size
    cli       ``kvtier check`` (the parser and its handler)

A check only looks: it creates, writes and deletes nothing, on the node or
on a server. Importing this package imports no backend.
"""
