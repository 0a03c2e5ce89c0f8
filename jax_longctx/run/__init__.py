"""Running a model with a method: the one prefill road (generation.prefill over chunked_prefill
and instructed), the decode loop, the mesh drivers (distributed/) and `driver.generate`, the one
public entry to all of them."""
