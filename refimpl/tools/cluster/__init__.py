"""The cluster model: predict memory and step time on many GPUs, plan a run, calibrate on this machine.

    hardware.py     a cluster's rates and links; presets a100-80gb, h100-80gb; JSON files
    collectives.py  the α–β cost of messages and ring / hierarchical collectives
    pipeline.py     the schedule simulator on the model's action times (long runs extrapolated)
    model.py        memory per GPU and time per step of one configuration (`predict`)
    context.py      context parallelism's attention: ring or Ulysses time, bytes and memory per rank
    plan.py         the search over dp × tp × cp × pp, ZeRO, recomputation, schedules, micro-batches (`plan`)
    calibrate.py    this machine's α, β, GEMM rate and per-operation overhead (`calibrate`)
    published.py    published results at 64+ GPUs, and the model's error on each

Commands: `python -m refimpl predict | plan | calibrate` (refimpl/tools/commands/); docs/cluster_model.md.
"""
