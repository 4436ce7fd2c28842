"""`kvflow bench pd`: an open-loop prefill/decode emulation of a real model on real GPUs.

Why a package: the workload (`workload`), the engines' sizing (`sizing`), the run that drives
P and D pairs of every system at every request rate (`run`) and its command line (`cli`) are
separate concerns; the step-time model lives with the stand-in engine it paces
(`kvflow_tools.standin.timing`).
"""
