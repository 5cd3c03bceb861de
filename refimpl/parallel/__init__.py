"""Parallelism: communication, data, tensor and pipeline parallelism and ZeRO over MPI.

    comm.py     the one wrapper over mpi4py (imported lazily): collectives, point-to-point,
                non-blocking requests and per-rank byte/call counters; a local one-process
                communicator with the same interface when there is no MPI
    ring.py     textbook ring reduce-scatter / all-gather / all-reduce / broadcast on
                point-to-point messages, selectable with collectives="ring"
    mesh.py     ranks laid out as a pp x dp x tp grid (Megatron-LM's order), one sub-communicator
                per axis
    trainer.py  the one distributed trainer; data_parallel.py, zero/, tensor_parallel/, pipeline/
                are its layers
    launched.py whether this process is a rank of an MPI job (the variables launchers set)
    context_parallel/  ring attention and Ulysses: one sequence's attention over C ranks
                (autograd Functions over a communicator; not yet an axis of the trainer)

The guards that end a job when a rank fails or hangs (a failure handler, a watchdog, a thread
budget, a keeper per rank) are tools: refimpl/tools/runtime/, installed through comm.Guard.

Importing this package imports nothing from MPI; see comm.get_world().
"""
