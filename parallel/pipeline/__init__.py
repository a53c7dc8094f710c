"""Pipeline parallelism: point-to-point transfers and the micro-batch schedules."""
