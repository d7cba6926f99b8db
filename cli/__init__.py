"""The ``rollout-fleet`` command: the composition root at the top of the layout.

It parses flags and the environment into frozen settings, configures logging, and composes
``schemas``, ``broker`` and ``workers`` into the verbs (:mod:`cli.main`). Nothing imports it.
"""
