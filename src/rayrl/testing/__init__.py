"""Testing aids that prove a run survives failures: faults injected into live workers
(`rayrl.testing.faults`) and the chaos monkey that SIGKILLs workers at random points of
a run (`rayrl.testing.chaos`).

For tests and benchmarks only: no module of the product imports this package
(tests/test_testing_apart.py checks it). It plugs into the product's public extension
point, call hooks (`rayrl.controller.calls`).
"""
