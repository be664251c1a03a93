"""One-off studies: where a step's time goes (breakdown), same-process A/B runs (decode_ab, space_ab,
launch_variants) and statistics over the shipped tuning databases (tuning_stats)."""
