"""refimpl: a readable, tested, pure-NumPy reference implementation of the memory and
parallelism algorithms used to train large models.

Importing refimpl never imports mpi4py: one-process use needs no MPI library. A communicator is
created only when `refimpl.parallel.comm` is asked for one.
"""

__version__ = "0.1.0"
