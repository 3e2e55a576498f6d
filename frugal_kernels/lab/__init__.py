"""The training application on top of the library: the corpus, the training loop, the demo,
the sweep, the peers' rows and the tuned learning rates.

Nothing in the library (ops, nn, optim, the governor, the bench) imports this package;
``frugal-kernels demo | train | sweep`` are its commands.
"""
