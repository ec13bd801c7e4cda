"""The host-side pictures of runs: `stackproof report` (needs the extra stackproof[report])."""
