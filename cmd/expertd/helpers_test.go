package main

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"time"

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
