"""This process in its job: its environment and place (env, layout), the process group and
collectives (dist), random states, SLURM, host memory, and every private torch API (compat)."""
