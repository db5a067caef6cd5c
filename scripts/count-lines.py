"""Counts the non-test Rust lines under a directory: every .rs line, leaving out files that are test-only modules (a `#[cfg(test)] mod x;` file and its folder) and each file from its `#[cfg(test)] mod x {` block on."""
import os,re,sys
root=sys.argv[1]
testfiles=set(); total=0
files=[os.path.join(d,f) for d,_,fs in os.walk(root) for f in fs if f.endswith('.rs')]
for p in files:
    src=open(p).read().split('\n')
    for i,l in enumerate(src):
        if l.strip()=='#[cfg(test)]' and i+1<len(src):
            m=re.match(r'\s*(pub )?mod (\w+);',src[i+1])
            if m: testfiles.add(os.path.join(os.path.dirname(p), m.group(2)))
for p in files:
    base=p[:-3]
    if base in testfiles or os.path.dirname(p) in testfiles: continue
    src=open(p).read().split('\n'); n=0
    for i,l in enumerate(src):
        if l.strip()=='#[cfg(test)]' and i+1<len(src) and re.match(r'\s*mod \w+ \{',src[i+1]): break
        n+=1
    total+=n
print(total)
