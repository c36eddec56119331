package main

import (
	"io"
	"os"
	"runtime/debug"
)

// Release builds stamp these with
// -ldflags "-X main.buildVersion=v1.2.0 -X main.buildCommit=<sha>"
// (docs/release.md); they override what the go tool recorded.
var (
	buildVersion string
	buildCommit  string
)

// stdout receives -version's line.
var stdout io.Writer = os.Stdout

// version is the daemon's version for -version, GetServerInfo, logs and
// telemetry: the stamped or module version (or "dev"), then the VCS
// commit the go tool recorded, marked dirty when the tree had changes,
// e.g. "v1.2.0 (commit 3f9c0e1d2a4b, dirty)".
func version() string {
	return formatVersion(debug.ReadBuildInfo())
}

func formatVersion(bi *debug.BuildInfo, ok bool) string {
	v, commit, modified := "dev", buildCommit, false
	if ok {
		if bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				if commit == "" {
					commit = s.Value
				}
			case "vcs.modified":
				modified = s.Value == "true" && buildCommit == ""
			}
		}
	}
	if buildVersion != "" {
		v = buildVersion
	}
	if commit == "" {
		return v
	}
	if len(commit) > 12 {
		commit = commit[:12]
	}
	if modified {
		return v + " (commit " + commit + ", dirty)"
	}
	return v + " (commit " + commit + ")"
}

// revision is the whole VCS commit: the stamped one, else the one the go
// tool recorded, else "unknown" (a build with -buildvcs=false or outside a
// repository).
func revision() string {
	if buildCommit != "" {
		return buildCommit
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && s.Value != "" {
				return s.Value
			}
		}
	}
	return "unknown"
}
