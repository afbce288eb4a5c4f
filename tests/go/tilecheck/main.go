// Command tilecheck verifies a pinvault ledger from what its tiles endpoint serves (C2SP
// tlog-tiles over HTTP) and nothing else, with Go's own transparency log code: it checks the
// signed checkpoint with the vault's verifier key, the inclusion of entries read from entry
// bundles, and the consistency of an older signed checkpoint with the latest one, each proof
// computed from hash tiles that are authenticated against the checkpoint's root as they load.
//
//	tilecheck -url http://127.0.0.1:8080/ -key 'origin+1234abcd+AQ…' -leaf 0,5,3000 -old old.note
//
// It prints one line and exits 0 when every check passed, 1 otherwise.
package main

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

const (
	tileHeight = 8
	tileWidth  = 1 << tileHeight
	// The most a full entry bundle can be: 256 entries of at most 65535 bytes and their lengths.
	maxResponse = tileWidth * (2 + 0xFFFF)
)

// A checkpoint as C2SP tlog-checkpoint writes it, once its signature has been checked.
type checkpoint struct {
	origin string
	tree   tlog.Tree
}

func main() {
	base := flag.String("url", "", "the tiles endpoint's URL prefix")
	vkey := flag.String("key", "", "the vault's verifier key (vault checkpoint --key)")
	leaves := flag.String("leaf", "", "comma-separated entry indexes to prove included")
	old := flag.String("old", "", "a file holding an older signed checkpoint to prove consistent")
	given := flag.String("checkpoint", "", "a file holding the signed checkpoint to verify the tiles of (default: the endpoint's)")
	flag.Parse()
	summary, err := run(*base, *vkey, *leaves, *old, *given)
	if err != nil {
		fmt.Printf("tilecheck: FAILED: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("tilecheck: OK: %s\n", summary)
}

func run(base, vkey, leaves, oldFile, givenFile string) (string, error) {
	if base == "" || vkey == "" {
		return "", errors.New("-url and -key are required")
	}
	verifier, err := note.NewVerifier(vkey)
	if err != nil {
		return "", fmt.Errorf("verifier key: %v", err)
	}
	fetcher := &fetcher{base: strings.TrimSuffix(base, "/") + "/", client: &http.Client{Timeout: 30 * time.Second}}
	var raw []byte
	if givenFile != "" {
		raw, err = os.ReadFile(givenFile)
	} else {
		raw, err = fetcher.get("checkpoint")
	}
	if err != nil {
		return "", err
	}
	latest, err := openCheckpoint(raw, verifier)
	if err != nil {
		return "", fmt.Errorf("checkpoint: %v", err)
	}
	tree := latest.tree
	hashes := tlog.TileHashReader(tree, &tileReader{fetcher: fetcher})
	done := []string{fmt.Sprintf("checkpoint %s size %d verified", latest.origin, tree.N)}

	if leaves != "" {
		indexes, err := parseIndexes(leaves)
		if err != nil {
			return "", err
		}
		for _, index := range indexes {
			if err := proveEntry(fetcher, hashes, tree, index); err != nil {
				return "", fmt.Errorf("entry %d: %v", index, err)
			}
		}
		done = append(done, fmt.Sprintf("inclusion of entries %s", leaves))
	}

	if oldFile != "" {
		raw, err := os.ReadFile(oldFile)
		if err != nil {
			return "", err
		}
		older, err := openCheckpoint(raw, verifier)
		if err != nil {
			return "", fmt.Errorf("older checkpoint: %v", err)
		}
		if older.origin != latest.origin {
			return "", fmt.Errorf("older checkpoint is of %q, not %q", older.origin, latest.origin)
		}
		if older.tree.N > tree.N {
			return "", fmt.Errorf("older checkpoint has size %d, larger than the latest %d", older.tree.N, tree.N)
		}
		proof, err := tlog.ProveTree(tree.N, older.tree.N, hashes)
		if err != nil {
			return "", fmt.Errorf("consistency proof from size %d: %v", older.tree.N, err)
		}
		if err := tlog.CheckTree(proof, tree.N, tree.Hash, older.tree.N, older.tree.Hash); err != nil {
			return "", fmt.Errorf("consistency from size %d to %d: %v", older.tree.N, tree.N, err)
		}
		done = append(done, fmt.Sprintf("consistency from size %d", older.tree.N))
	}
	return strings.Join(done, "; "), nil
}

// openCheckpoint checks the note's signature by the vault's key and parses its body: the
// origin (which must be the key's name, as pinvault signs), the size and the root.
func openCheckpoint(raw []byte, verifier note.Verifier) (*checkpoint, error) {
	n, err := note.Open(raw, note.VerifierList(verifier))
	if err != nil {
		return nil, err
	}
	lines := strings.SplitN(n.Text, "\n", 4)
	if len(lines) < 4 {
		return nil, errors.New("the body is not origin, size and root lines")
	}
	if lines[0] != verifier.Name() {
		return nil, fmt.Errorf("origin %q is not the key's %q", lines[0], verifier.Name())
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil || size < 0 || strconv.FormatInt(size, 10) != lines[1] {
		return nil, fmt.Errorf("bad tree size %q", lines[1])
	}
	root, err := base64.StdEncoding.Strict().DecodeString(lines[2])
	if err != nil || len(root) != tlog.HashSize {
		return nil, fmt.Errorf("bad root %q", lines[2])
	}
	var hash tlog.Hash
	copy(hash[:], root)
	return &checkpoint{origin: lines[0], tree: tlog.Tree{N: size, Hash: hash}}, nil
}

// proveEntry reads entry `index` from its bundle and checks that it is in the tree.
func proveEntry(f *fetcher, hashes tlog.HashReader, tree tlog.Tree, index int64) error {
	if index < 0 || index >= tree.N {
		return fmt.Errorf("not in a tree of size %d", tree.N)
	}
	bundle := tlog.Tile{H: tileHeight, L: -1, N: index / tileWidth, W: tileWidth}
	if rest := tree.N - bundle.N*tileWidth; rest < tileWidth {
		bundle.W = int(rest)
	}
	data, err := f.get(tilePath(bundle))
	var missing *notFound
	partial := bundle.W < tileWidth && errors.As(err, &missing)
	if partial {
		// A log may drop a partial entry bundle once the full one is written, as it may a
		// partial hash tile (C2SP tlog-tiles): its first entries are the same.
		full := bundle
		full.W = tileWidth
		data, err = f.get(tilePath(full))
	}
	if err != nil {
		return err
	}
	entries, err := splitBundle(data)
	if err != nil {
		return fmt.Errorf("%s: %v", tilePath(bundle), err)
	}
	if partial && len(entries) >= bundle.W {
		entries = entries[:bundle.W]
	}
	if len(entries) != bundle.W {
		return fmt.Errorf("%s holds %d entries, not %d", tilePath(bundle), len(entries), bundle.W)
	}
	entry := entries[index%tileWidth]
	proof, err := tlog.ProveRecord(tree.N, index, hashes)
	if err != nil {
		return fmt.Errorf("inclusion proof: %v", err)
	}
	if err := tlog.CheckRecord(proof, tree.N, tree.Hash, index, tlog.RecordHash(entry)); err != nil {
		return fmt.Errorf("inclusion in the tree of size %d: %v", tree.N, err)
	}
	return nil
}

// splitBundle splits an entry bundle into its entries, each after a big-endian uint16 length.
func splitBundle(data []byte) ([][]byte, error) {
	var entries [][]byte
	for len(data) > 0 {
		if len(data) < 2 {
			return nil, errors.New("truncated length")
		}
		size := int(binary.BigEndian.Uint16(data))
		if len(data) < 2+size {
			return nil, errors.New("truncated entry")
		}
		entries = append(entries, data[2:2+size])
		data = data[2+size:]
	}
	return entries, nil
}

func parseIndexes(list string) ([]int64, error) {
	var indexes []int64
	for _, field := range strings.Split(list, ",") {
		index, err := strconv.ParseInt(field, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("bad entry index %q", field)
		}
		indexes = append(indexes, index)
	}
	return indexes, nil
}

// tilePath is a tile's path as C2SP tlog-tiles writes it: tlog's own path without the height
// element, and `entries` for the level of entry bundles.
func tilePath(t tlog.Tile) string {
	path := strings.TrimPrefix(t.Path(), fmt.Sprintf("tile/%d/", t.H))
	if t.L == -1 {
		path = "entries" + strings.TrimPrefix(path, "data")
	}
	return "tile/" + path
}

type fetcher struct {
	base   string
	client *http.Client
}

type notFound struct{ path string }

func (e *notFound) Error() string { return fmt.Sprintf("GET %s: 404 Not Found", e.path) }

func (f *fetcher) get(path string) ([]byte, error) {
	response, err := f.client.Get(f.base + path)
	if err != nil {
		return nil, err
	}
	defer response.Body.Close()
	if response.StatusCode == http.StatusNotFound {
		return nil, &notFound{path}
	}
	if response.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", path, response.Status)
	}
	data, err := io.ReadAll(io.LimitReader(response.Body, maxResponse+1))
	if err != nil {
		return nil, fmt.Errorf("GET %s: %v", path, err)
	}
	if len(data) > maxResponse {
		return nil, fmt.Errorf("GET %s: more than %d bytes", path, maxResponse)
	}
	return data, nil
}

// tileReader fetches hash tiles for tlog.TileHashReader, which authenticates each one.
type tileReader struct{ fetcher *fetcher }

func (r *tileReader) Height() int { return tileHeight }

func (r *tileReader) ReadTiles(tiles []tlog.Tile) ([][]byte, error) {
	data := make([][]byte, len(tiles))
	for i, t := range tiles {
		tile, err := r.fetcher.get(tilePath(t))
		var missing *notFound
		if errors.As(err, &missing) && t.W < tileWidth {
			// A log may drop a partial tile once the full one is written (C2SP tlog-tiles):
			// its first hashes are the same.
			full := t
			full.W = tileWidth
			tile, err = r.fetcher.get(tilePath(full))
			if err == nil && len(tile) >= t.W*tlog.HashSize {
				tile = tile[:t.W*tlog.HashSize]
			}
		}
		if err != nil {
			return nil, err
		}
		if len(tile) != t.W*tlog.HashSize {
			return nil, fmt.Errorf("%s is %d bytes, not %d", tilePath(t), len(tile), t.W*tlog.HashSize)
		}
		data[i] = tile
	}
	return data, nil
}

func (r *tileReader) SaveTiles([]tlog.Tile, [][]byte) {}
