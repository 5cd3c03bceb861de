"""cupyx.scipy for the CPU stand-in of CuPy."""
