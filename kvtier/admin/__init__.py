"""The administration commands: what an operator runs on a store or a key
file from outside the engines.

    storecli      ``kvtier store ls|stat|verify|gc``
    dirstore      ``AdminStore``: a directory tier's store opened for it
    redis_verify  ``kvtier store verify --tier redis://...``
    s3_verify     ``kvtier store verify --tier s3://...``
    authcli       ``kvtier auth keygen|id|add|promote|remove``

They use the tiers as the engines do (``tiers/``, ``auth``); nothing below
imports them. ``kvtier check`` (a node before a rollout) is its own package,
``check/``.
"""
