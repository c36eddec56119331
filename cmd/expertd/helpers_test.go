package main

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"time"

	"github.com/expertd/expertd/client"
	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
	"github.com/expertd/expertd/scaling"
)

const defaultTestTimeout = 20 * time.Second

func tensor(dt pb.DataType, data []byte, shape ...int64) *pb.Tensor {
	return &pb.Tensor{Dtype: dt, Shape: shape, Source: &pb.Tensor_Data{Data: data}}
}

func f32(v ...float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func randF32(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64())
	}
	return v
}

func randFP8(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = scaling.Float32ToE4M3(float32(rng.NormFloat64() * 100))
	}
	return b
}

// relu2Weights is a random ReLU² layer of E = 4 experts for the SDK.
func relu2Weights(rng *rand.Rand, k, n int) *client.ExpertWeights {
	const e = 4
	return &client.ExpertWeights{
		Activation: moe.Relu2,
		W13:        client.FromFP8(randFP8(rng, e*n*k), e, n, k),
		W2:         client.FromFP8(randFP8(rng, e*k*n), e, k, n),
		W13Scale:   client.FromFloat32([]float32{0.001, 0.002, 0.003, 0.004}, e),
		W2Scale:    client.FromFloat32([]float32{0.004, 0.003, 0.002, 0.001}, e),
	}
}
