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
    failure.py  a failure on any rank aborts every rank with "[rank R] ErrorType: message"
    watchdog.py a hang (a stopped rank, a loop, mismatched collectives) aborts the job after
                --timeout seconds without progress, naming the ranks that did not arrive
    threads.py  one BLAS/OpenMP thread budget per machine: max(1, cores // ranks on the node)
    launcher.py the environment variables an MPI launcher sets for its ranks, and finding mpiexec

Importing this package imports nothing from MPI; see comm.get_world().
"""
