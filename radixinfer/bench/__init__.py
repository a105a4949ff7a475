"""``radixinfer bench``: a streaming benchmark of the running engine (what it reports:
docs/api.md, The streaming benchmark; how to run: benchmarks/README.md).

    args       the flags (the seed engine's names kept)        workloads  sessions of token ids, arrivals
    backends   the Backend interface, radixinfer's backend     hf         the transformers baseline
    runner     the one run loop, variants, warm-up / repeats   metrics    per-request records, summaries
    report     tables and speedups                             suite      many command lines, one process
"""
