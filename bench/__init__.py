"""Benchmarks of the fleet beside its anchors (direct HTTP, arq, streaq, Redis PING, memcpy).

Benchmarks measure and print ratios; they never assert speeds. Each module runs alone
(``python -m bench.round_trip --size smoke``) and ``bench.run_all.main`` runs them all.
"""
