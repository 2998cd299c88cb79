"""Side-by-side benchmarks of ``samplers`` against hand-written code and peer libraries."""
