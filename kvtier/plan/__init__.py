"""``kvtier plan``: capacity planning from request traces.

    traces    the internal request form and block-id normalisation
    loaders   Mooncake FAST'25, Alibaba Bailian and kvtier request logs
    synth     synthetic multi-turn traces (and bench workloads as traces)
    models    kvtier's tiers over their own eviction policies, as data structures without I/O
    storemodel  TieredStore's lookup, fetch (promotion) and put over those models
    stack     one-pass hit ratio against capacity (Mattson stack distances)
    cost      prefill and load time models, calibration
    sim       the replay: engine prefix cache, tiers, instances, routing, TTFT
    report    curves, knee, recommendations, Markdown and plots
    validate  replay a ``kvtier bench resume`` log and compare with what it measured
    cli       ``kvtier plan``

Importing this package imports neither numpy nor matplotlib.
"""
