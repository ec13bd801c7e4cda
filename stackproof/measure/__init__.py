"""Measure: what the checks read and time, deciding nothing. NVML and sysfs (topology, health, identity), the
image's versions (pins), the GPU and its links timed (gpu_proof, bandwidth, pairwise, stragglers), the inputs with
known answers (known_answers, training), and a user's baseline file (baseline). Verdicts are stackproof/judge/'s."""
