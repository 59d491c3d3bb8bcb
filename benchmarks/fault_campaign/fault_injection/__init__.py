"""The random fault-injection campaign behind ``python benchmarks/fault_campaign`` (docs/reliability.md).

``runs`` starts and watches ``python -m mlptrain`` runs, ``trial`` interrupts one run at random until it
finishes, ``check`` compares it with the uninterrupted run, ``partial`` does the same for a loop of
``MLPClassifier.partial_fit`` calls saved after each, and ``report`` writes what was found.
"""
