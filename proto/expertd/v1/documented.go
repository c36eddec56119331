package expertdv1

import (
	_ "embed" // the documented descriptor set
	"fmt"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
)

// documentedSet is expert.proto compiled with its comments by
// scripts/gen-proto.sh. protoc-gen-go drops comments from the descriptor it
// embeds in expert.pb.go, which would leave grpcurl describe mute.
//
//go:embed expert.binpb
var documentedSet []byte

// DocumentedFiles returns a descriptor resolver that serves expert.proto
// with its comments and every other file (imports, health, reflection)
// from the global registry. Give it to server reflection so `grpcurl
// describe` shows the API's documentation.
func DocumentedFiles() (protodesc.Resolver, error) {
	var set descriptorpb.FileDescriptorSet
	if err := proto.Unmarshal(documentedSet, &set); err != nil {
		return nil, fmt.Errorf("expertdv1: documented descriptor set: %w", err)
	}
	files := new(protoregistry.Files)
	for _, fdp := range set.GetFile() {
		fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
		if err != nil {
			return nil, fmt.Errorf("expertdv1: documented descriptor %s: %w", fdp.GetName(), err)
		}
		if err := files.RegisterFile(fd); err != nil {
			return nil, fmt.Errorf("expertdv1: documented descriptor %s: %w", fdp.GetName(), err)
		}
	}
	return overlay{files}, nil
}

// overlay resolves from its own files first, then the global registry.
type overlay struct{ files *protoregistry.Files }

func (o overlay) FindFileByPath(path string) (protoreflect.FileDescriptor, error) {
	if fd, err := o.files.FindFileByPath(path); err == nil {
		return fd, nil
	}
	return protoregistry.GlobalFiles.FindFileByPath(path)
}

func (o overlay) FindDescriptorByName(name protoreflect.FullName) (protoreflect.Descriptor, error) {
	if d, err := o.files.FindDescriptorByName(name); err == nil {
		return d, nil
	}
	return protoregistry.GlobalFiles.FindDescriptorByName(name)
}
