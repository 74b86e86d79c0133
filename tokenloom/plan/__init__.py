"""`tokenloom plan`: a capacity planner. A discrete-event simulation of a fleet of workers, each running the
engine's own Scheduler and KV cache manager on simulated time, with step costs measured from the real
engine (profile.py) or derived from a hardware roofline (hardware.py)."""
