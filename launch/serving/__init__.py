"""OpenAI-compatible serving: HTTP server (rank 0), protocol parsing, the bridge between the HTTP
thread and the engine, the lockstep serve loop with its DP load balancer, metrics (text handling,
shared with the offline API: ``launch.text``)."""
