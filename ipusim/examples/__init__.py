"""Runnable examples of the ipusim device layer (`python -m ipusim.examples.matmul`)."""
