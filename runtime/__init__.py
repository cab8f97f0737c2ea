"""Schedules, communication and executors (installed as `pdcompile.runtime`).

Empty until the runtime issue lands; the package exists so the installed layout is final.
"""
