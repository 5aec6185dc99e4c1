"""The harness the benchmark commands share; no command lives here (see `lmqueue.bench.commands`).

The stack and what it measures
    stack           private Redis servers, worker pools, connected clients, `CpuMeter`
    load            closed-loop load, the measurement window, their flags and figures
    tails           percentiles, spreads across runs, GC pauses
    memory_bounds   RSS sampling and the bounds the memory benchmark checks
    devices         where models run (``--device``) and the GPU memory each process holds
    report          `Report`: what every command prints and writes, in one shape
Workloads and anchors
    workload        the SMC workload (`run_smc` on a fixed prompt), one torch thread a client
    anchor_grid     genlm-backend in-process at its best knobs: the anchor of the ratios
    adapter_models  random LoRA adapters and merged copies (PEFT)
    call_loop       closed loops of calls on one client (fairness)
Child processes (``python -m lmqueue.bench.lib.<module>``) and their drivers
    json_child      a child driven by a JSON line each way
    loop_process    a tenant's loop of calls in a process of its own (fairness)
    transport_client  one client process of ``transport --clients N``
    program_runner  one SMC program in a process of its own (programs, adapters)
    probe_reader    the raw probe's consumer; `probe` drives it
    plain_vllm      plain vLLM asked for full rows (engines)
Parts of one command
    transport_scale ``transport --clients N --workers M``
    scaling_hf      ``scaling`` with real work
    fairness_model  ``fairness --real-repeats N``
    fairness_plot   the plot of ``fairness``
"""
