"""Operating runs: zoo's launcher (launch/run.py, deepspeed's runner waited for to the last rank), the ranks'
watch on their launcher, the stop requests a process records, the stop report a run leaves, a rank's output
surviving a broken pipe, the lock that makes one run own its directory, and the build environment's CUDA
architectures. It sits below everything that trains, so any layer may report a stop or hold the lock."""
