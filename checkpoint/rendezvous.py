"""Where a process stands in a torch.distributed job, from its launcher's environment: torchrun's RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, or one SLURM task per rank (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID). Shared by the
trainer (train.loop) and the multi-rank converters (convert.distributed); it imports nothing of torch."""
from __future__ import annotations

from .errors import ConfigError


def rendezvous_env(env, command: str) -> None:
    """One SLURM task per rank (srun, as `shardkit launch`'s job.sbatch runs it): RANK, WORLD_SIZE and LOCAL_RANK from
    SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID. A rank of a job of several without what the rendezvous needs, or
    whose world size contradicts its launcher's, is a ConfigError naming the rank and what is missing or differs, at
    start (not a traceback, nor a wait for ranks that never come). `command` names the subcommand in the message."""
    how = "torchrun-style"
    if "RANK" not in env and "SLURM_PROCID" in env:
        how = "a SLURM task (SLURM_PROCID)"
        ntasks = env.get("SLURM_NTASKS", "1")  # set in srun steps and with --ntasks
        if ntasks == "1" and not env.get("MASTER_ADDR"):
            return  # one task (a batch script without srun, too): one process, no rendezvous
        missing = [k for k in ("SLURM_NTASKS", "SLURM_LOCALID") if not env.get(k, "").isdigit()]
        if missing:
            raise ConfigError(f"{command}: SLURM task {env['SLURM_PROCID']} starts without "
                              f"{' and '.join(missing)}: start one task per rank with srun (the job.sbatch `shardkit "
                              "launch --slurm` writes does)")
        if env.get("WORLD_SIZE") and env["WORLD_SIZE"] != ntasks:
            raise ConfigError(f"{command}: rank {env['SLURM_PROCID']} ({how}): WORLD_SIZE={env['WORLD_SIZE']} but "
                              f"SLURM_NTASKS={ntasks}: the world size does not match the SLURM job; unset WORLD_SIZE "
                              "or start as many tasks")
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], ntasks
        env.setdefault("LOCAL_RANK", env["SLURM_LOCALID"])
    if "RANK" in env:
        missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ConfigError(f"{command}: rank {env['RANK']} ({how}) starts without "
                              f"{', '.join(missing)}: the rendezvous needs the world size and rank 0's address and "
                              "port; export MASTER_ADDR (the first node of SLURM_JOB_NODELIST) and MASTER_PORT before "
                              "srun, as `shardkit launch --slurm`'s job.sbatch does, or start the ranks with torchrun")


def launcher_rank(env) -> int | None:
    """This process's rank as its launcher set it (torchrun's RANK, else SLURM's SLURM_PROCID), unchecked, before
    any rendezvous; None where there is none (or it is not a number): for work only rank 0 starts early."""
    rank = env.get("RANK", env.get("SLURM_PROCID"))
    return int(rank) if rank is not None and rank.isdigit() else None


def rank_and_world(env, command: str) -> tuple[int, int] | None:
    """(rank, world size) of a process started as one rank of several (after `rendezvous_env`); None for a single
    process. A RANK or WORLD_SIZE that is not a number, or a rank outside the world, is a ConfigError naming it."""
    rendezvous_env(env, command)
    if "RANK" not in env:
        return None
    rank, world = env["RANK"], env["WORLD_SIZE"]
    if not rank.isdigit() or not world.isdigit() or int(world) < 1:
        raise ConfigError(f"{command}: RANK={rank!r} WORLD_SIZE={world!r}: expected a rank number and a world size "
                          ">= 1 (as torchrun sets them)")
    if int(rank) >= int(world):
        raise ConfigError(f"{command}: rank {rank} is outside the world of WORLD_SIZE={world} ranks (0 to "
                          f"{int(world) - 1}): the world size does not match the ranks started")
    return int(rank), int(world)
