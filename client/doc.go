// Package client is the Go SDK of expertd: it dials a server, uploads
// expert sets in chunks, and runs fused MoE layers with typed tensors.
//
//	c, err := client.Dial(ctx, "localhost:50051")
//	if err != nil { ... }
//	defer c.Close()
//
//	// One layer: E experts, hidden size K, intermediate size N, FP8 codes
//	// with one FP32 scale per expert.
//	_, err = c.LoadExperts(ctx, "layer0", &client.ExpertWeights{
//		Activation: moe.SiluGated,
//		W13:        client.FromFP8(w13, E, 2*N, K),
//		W2:         client.FromFP8(w2, E, K, N),
//		W13Scale:   client.FromFloat32(w13Scale, E),
//		W2Scale:    client.FromFloat32(w2Scale, E),
//	}, client.OnProgress(func(p client.Progress) { log.Printf("%d/%d bytes", p.SentBytes, p.TotalBytes) }))
//
//	res, err := c.FusedMoE(ctx, &client.FusedMoERequest{
//		ExpertSet:    "layer0",
//		Hidden:       client.BFloat16FromFloat32(hidden, M, K),
//		RouterLogits: client.FromFloat32(logits, M, E),
//		Routing:      client.Routing{TopK: 2, Renormalize: true},
//		OutputDType:  moe.Float32,
//	})
//	out, err := res.Output.Float32s() // [M, K]
//	res.Release() // optional: the next call reuses its receive buffer
//
// Element types, activations and scorings are the request model's, package
// moe's (moe.Float32, moe.SiluGated, moe.Sigmoid), which the server shares;
// the same names in this package are deprecated aliases of them.
//
// FusedMoEStream keeps many calls in flight on one stream, answered in
// order. On the daemon's host (which needs -shared-memory),
// CreateSharedMemory and RegisterSharedMemory let tensors and outputs stay
// in POSIX shared memory instead of messages, and
// RegisterCUDASharedMemory lets them stay in the caller's GPU memory
// (CUDA IPC). ListExperts, UnloadExperts, ServerInfo, Health and
// LoadSafetensors cover the rest of the service; RPC exposes the
// generated stub for anything else. Sharded runs a layer whose experts
// are spread over several daemons (expert parallelism, docs/sharding.md).
//
// Errors carry the server's gRPC status (status.Code(err) is
// InvalidArgument, NotFound, ResourceExhausted, Unavailable, ...); the
// client refuses a malformed tensor itself with InvalidArgument before
// sending it. A failed call's error is an *Error (errors.As), whose Field,
// QuotaViolations and RetryDelay read the status's AIP-193 details: the
// request field an InvalidArgument names, the limit a ResourceExhausted
// hit, and when to retry a full queue. FusedMoE waits that long and
// retries, within its attempts and the context's deadline.
//
// Defaults: plaintext (the daemon listens on loopback), 1 GiB messages,
// 2 MiB upload chunks, no call timeout beyond the context's
// (WithCallTimeout adds one). ListExperts, ServerInfo, Health and FusedMoE
// are retried on Unavailable through gRPC's retry policy, up to 5
// attempts with backoff from 100 ms, all within the context's deadline;
// LoadExperts and UnloadExperts never are, since repeating them is not
// the same as doing them once. A lost connection is re-established with
// backoff from 100 ms up to 2 s; WithWaitForReady makes calls wait for it
// (up to their deadline) instead of failing with Unavailable. The client
// pings a connection quiet for 30 s (DefaultKeepaliveTime), within what
// the daemon allows by default; WithKeepalive changes that for servers
// or proxies with another policy.
//
// For a daemon with authorization, WithBearerToken sends a token on every
// call; it needs WithTransportCredentials (TLS, or mutual TLS with a
// client certificate) unless the daemon is on a loopback address.
//
// The module's tests and examples call an in-process server
// (internal/testdaemon); package clienttest converts kerneltest cases
// into the SDK's request types.
package client
