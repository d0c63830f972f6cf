package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime"

	"github.com/klauspost/cpuid/v2"
	"golang.org/x/sys/unix"

	"github.com/kvshim/kvshim/ipc"
)

// CUDAProbe reports whether a CUDA driver can be opened: a description on
// success, or an error whose text is a sentence for the operator. The cuda
// package sets it (cli must not depend on cgo packages for its tests).
var CUDAProbe = func() (string, error) {
	return "", fmt.Errorf("no CUDA probe linked into this binary")
}

// Report is what `kvshim doctor` finds; --json prints it as is.
type Report struct {
	Version      string   `json:"version"`
	ABI          int      `json:"abi_version"`
	Protocol     uint32   `json:"protocol_version"`
	GoVersion    string   `json:"go_version"`
	CPU          string   `json:"cpu"`
	LogicalCores int      `json:"logical_cores"`
	CacheLine    int      `json:"cache_line_bytes"`
	Features     []string `json:"cpu_features"`
	CUDA         string   `json:"cuda"`
	CUDAOK       bool     `json:"cuda_ok"`
	ShmBytes     uint64   `json:"dev_shm_bytes"`
	ShmFreeBytes uint64   `json:"dev_shm_free_bytes"`
	MemfdOK      bool     `json:"memfd_ok"`
	MemlockBytes int64    `json:"memlock_limit_bytes"` // -1 = unlimited
	Problems     []string `json:"problems"`
	Warnings     []string `json:"warnings"`
	Verdict      string   `json:"verdict"`
}

// features that matter for copies (wide loads/stores) and hashing (SHA-NI, CRC32).
var watched = []struct {
	name string
	id   cpuid.FeatureID
}{
	{"AVX2", cpuid.AVX2},
	{"AVX512F", cpuid.AVX512F},
	{"AVX512BW", cpuid.AVX512BW},
	{"ERMS", cpuid.ERMS},
	{"FSRM", cpuid.FSRM},
	{"SHA", cpuid.SHA},
	{"SSE4.2", cpuid.SSE42},
}

func diagnose(info Info) Report {
	r := Report{
		Version:      info.Version,
		ABI:          info.ABI,
		Protocol:     ipc.ProtocolVersion,
		GoVersion:    runtime.Version(),
		CPU:          cpuid.CPU.BrandName,
		LogicalCores: runtime.NumCPU(),
		CacheLine:    cpuid.CPU.CacheLine,
		Problems:     []string{},
		Warnings:     []string{},
	}
	for _, f := range watched {
		if cpuid.CPU.Supports(f.id) {
			r.Features = append(r.Features, f.name)
		}
	}
	if !cpuid.CPU.Supports(cpuid.AVX2) {
		r.Warnings = append(r.Warnings, "no AVX2: host copies and hashing run slower")
	}

	if desc, err := CUDAProbe(); err != nil {
		r.CUDA = err.Error() + " (GPU copies are off; the host engine still works)"
	} else {
		r.CUDA, r.CUDAOK = desc, true
	}

	var st unix.Statfs_t
	if err := unix.Statfs("/dev/shm", &st); err != nil {
		r.Warnings = append(r.Warnings, fmt.Sprintf("cannot stat /dev/shm: %v (only needed where memfd is missing)", err))
	} else {
		r.ShmBytes = st.Blocks * uint64(st.Bsize)
		r.ShmFreeBytes = st.Bavail * uint64(st.Bsize)
	}

	if fd, err := unix.MemfdCreate("kvshim-doctor", unix.MFD_CLOEXEC); err != nil {
		r.MemfdOK = false
		if r.ShmBytes == 0 {
			r.Problems = append(r.Problems, fmt.Sprintf("memfd_create failed (%v) and /dev/shm is unusable: L1 has no shared memory", err))
		} else {
			r.Warnings = append(r.Warnings, fmt.Sprintf("memfd_create failed (%v): L1 falls back to /dev/shm files", err))
		}
	} else {
		r.MemfdOK = true
		unix.Close(fd)
	}

	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl); err == nil {
		if rl.Cur == unix.RLIM_INFINITY {
			r.MemlockBytes = -1
		} else {
			r.MemlockBytes = int64(rl.Cur)
			if rl.Cur < 64<<20 {
				r.Warnings = append(r.Warnings, fmt.Sprintf("memlock limit is %d KiB: RDMA registration of L1 (Mooncake) needs it raised (ulimit -l unlimited)", rl.Cur>>10))
			}
		}
	}

	switch {
	case len(r.Problems) > 0:
		r.Verdict = "NOT READY: " + r.Problems[0]
	case r.CUDAOK:
		r.Verdict = "ready: shared-memory L1 and GPU copies available"
	default:
		r.Verdict = "ready for CPU KV caches: shared-memory L1 available, no CUDA driver"
	}
	return r
}

func runDoctor(args []string, info Info, stdout, stderr io.Writer) int {
	fs := newFlagSet("doctor", "Check this machine for kvshim: library, CPU features, CUDA driver, shared\nmemory, memlock; exit 1 when it is not ready.")
	asJSON := fs.Bool("json", false, "print the report as one JSON object")
	if code, ok := fs.parse(args, stdout, stderr); !ok {
		return code
	}
	r := diagnose(info)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		if err := enc.Encode(r); err != nil {
			return 1
		}
	} else {
		printReport(stdout, r)
	}
	if len(r.Problems) > 0 {
		return 1
	}
	return 0
}

func printReport(w io.Writer, r Report) {
	mem := "unlimited"
	if r.MemlockBytes >= 0 {
		mem = fmt.Sprintf("%d KiB", r.MemlockBytes>>10)
	}
	fmt.Fprintf(w, "library      kvshim %s (ABI %s, protocol %d, %s)\n", r.Version, ABIString(r.ABI), r.Protocol, r.GoVersion)
	fmt.Fprintf(w, "cpu          %s, %d logical cores, cache line %d B\n", r.CPU, r.LogicalCores, r.CacheLine)
	fmt.Fprintf(w, "features     %v\n", r.Features)
	fmt.Fprintf(w, "cuda         %s\n", r.CUDA)
	fmt.Fprintf(w, "/dev/shm     %d MiB (%d MiB free)\n", r.ShmBytes>>20, r.ShmFreeBytes>>20)
	fmt.Fprintf(w, "memfd        %v\n", r.MemfdOK)
	fmt.Fprintf(w, "memlock      %s\n", mem)
	for _, p := range r.Problems {
		fmt.Fprintf(w, "PROBLEM      %s\n", p)
	}
	for _, x := range r.Warnings {
		fmt.Fprintf(w, "warning      %s\n", x)
	}
	fmt.Fprintf(w, "verdict      %s\n", r.Verdict)
}

func init() {
	commands["doctor"] = command{"check this machine: library, CPU, CUDA driver, shared memory, memlock", runDoctor}
}
